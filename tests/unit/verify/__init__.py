"""Unit tests of verify/, one file per module."""
