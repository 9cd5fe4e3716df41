"""HDF5 objects made the way a trace needs them, through h5py's low-level API.

Every object the recorder makes is made here: datasets (``new_dataset``, which ``schema.Element.create``
calls), groups and attributes, each with the creation properties a trace needs (no time stamps, attribute
order not tracked, strings fixed-length and inline in the checksummed object header) and made in a quarter
of the time h5py's high-level calls take (a layer has 18 small datasets, 26 at the sampled level). ``LIBVER``
is the object format the file is opened with.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import h5py
import numpy as np

# HDF5 1.8 object formats and newer carry checksums on every metadata block, so damaged metadata is
# detected instead of being followed (the 1.6-compatible default can send the library into a loop on a
# corrupted file); "v110" as the newest keeps files readable by HDF5 1.10 tools such as Debian's h5dump.
LIBVER = ("v108", "v110")


def text_attr(obj, key: str, value: str) -> None:
    """A string attribute stored fixed-length, inline in its (checksummed) object header.

    Variable-length strings live in HDF5's global heap, which has no checksum: a damaged heap can send
    the library into an endless loop when the attribute is read (found by fuzzing the reader).
    """
    obj.attrs[key] = np.bytes_(value.encode("utf-8"))


class _Kind(NamedTuple):
    """What a new dataset or attribute of one kind is made from (low-level h5py objects, reusable)."""
    file_type: object  # h5py.h5t.TypeID as stored
    memory_type: object  # h5py.h5t.TypeID of the numpy data (attributes)
    space: object  # h5py.h5s.SpaceID
    dcpl: object  # h5py.h5p.PropDCID (datasets; None for attributes)


@functools.lru_cache(maxsize=64)
def _creation(dtype: str, shape: tuple, maxshape: tuple | None, chunks: tuple | None, fill: str | None,
              gzip: bool = False) -> _Kind:
    """(datatype, dataspace, creation property list) of a new dataset, made once per kind: what h5py's
    create_dataset sets (chunks, with ``gzip`` the shuffle filter and deflate level 1, fill value; no time
    stamps, attribute order not tracked)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    if chunks is not None:
        dcpl.set_chunk(chunks)
    if gzip:
        dcpl.set_shuffle()
        dcpl.set_deflate(1)
    if fill is not None:
        dcpl.set_fill_value(np.array(float(fill) if fill == "nan" else int(fill)))
    dcpl.set_obj_track_times(False)
    dcpl.set_attr_creation_order(0)
    unlimited = None if maxshape is None else tuple(h5py.h5s.UNLIMITED if m is None else m for m in maxshape)
    return _Kind(file_type=h5py.h5t.py_create(np.dtype(dtype), logical=1), memory_type=None,
                 space=h5py.h5s.create_simple(shape, unlimited), dcpl=dcpl)


def new_dataset(group, rel: str, shape: tuple, dtype, data: np.ndarray | None = None, fill=None, chunks=None,
                maxshape=None, gzip: bool = False) -> h5py.h5d.DatasetID:
    """A new dataset ``rel`` of ``shape`` and ``dtype`` in ``group`` (an h5py group or its low-level id; groups
    on the way are made), holding ``data`` if given: what ``group.create_dataset(rel, shape, dtype, data=data,
    fillvalue=fill, chunks=chunks, maxshape=maxshape, compression="gzip", compression_opts=1, shuffle=True)``
    makes (the compression only with ``gzip``), through h5py's low-level API. ``fill``: an integer or NaN.
    Called by ``schema.Element.create``, the one way a trace's datasets are made."""
    shape = tuple(shape)
    if data is not None and data.shape != shape:
        raise ValueError(f"internal: {rel} holds shape {data.shape}, the format says {shape}")
    key = None if fill is None else ("nan" if np.isnan(fill) else str(int(fill)))
    kind = _creation(np.dtype(dtype).str, shape, maxshape, chunks, key, gzip)
    gid = group.id if isinstance(group, h5py.Group) else group
    lcpl = _group_plists()[0] if "/" in rel else None
    dsid = h5py.h5d.create(gid, rel.encode("ascii"), kind.file_type, kind.space, dcpl=kind.dcpl, lcpl=lcpl)
    if data is not None:
        dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, data)
    return dsid


@functools.lru_cache(maxsize=1)
def _group_plists() -> tuple:
    """(link, group) creation property lists of a new group, made once: what h5py's create_group passes for an
    ASCII name (no time stamps, link order not tracked)."""
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    lcpl.set_char_encoding(h5py.h5t.CSET_ASCII)
    gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    return lcpl, gcpl


def new_group(parent, name: str) -> h5py.h5g.GroupID:
    """A new group ``name`` under ``parent`` (a low-level id): what ``create_group`` makes, without its checks."""
    lcpl, gcpl = _group_plists()
    return h5py.h5g.create(parent, name.encode("ascii"), lcpl=lcpl, gcpl=gcpl)


@functools.lru_cache(maxsize=64)
def _attr_kind(dtype: str, shape: tuple) -> _Kind:
    """The types and dataspace of a new attribute, made once per kind, as h5py's attrs.create makes them."""
    dt = np.dtype(dtype)
    return _Kind(file_type=h5py.h5t.py_create(dt, logical=True), memory_type=h5py.h5t.py_create(dt),
                 space=h5py.h5s.create_simple(shape), dcpl=None)


def new_attr(oid, name: str, value) -> None:
    """Attribute ``name`` = ``value`` on a new object (low-level id) that has no such attribute yet: what
    ``obj.attrs[name] = value`` writes, without its checks for an attribute to replace. A str is stored as
    text_attr stores it (fixed-length UTF-8)."""
    data = np.asarray(np.bytes_(value.encode("utf-8")) if isinstance(value, str) else value)
    kind = _attr_kind(data.dtype.str, data.shape)
    attr = h5py.h5a.create(oid, name.encode("ascii"), kind.file_type, kind.space)
    attr.write(data, mtype=kind.memory_type)
    attr.close()
