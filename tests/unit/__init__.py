"""Unit tests, one file per module."""
