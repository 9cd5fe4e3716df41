"""prefill-diff traces: the HDF5 format (docs/trace-format.md), its Recorder and its reader.

Importing this package does not import torch.
"""
from .reader import Trace, TraceError
from .placement import TraceExistsError
from .recorder import Recorder
from .schema import FORMAT_NAME, FORMAT_VERSION
from .trace_file import RecorderError

__all__ = ["Recorder", "RecorderError", "TraceExistsError", "Trace", "TraceError", "FORMAT_NAME",
           "FORMAT_VERSION"]
