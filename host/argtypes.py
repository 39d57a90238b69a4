"""argparse types shared by the command-line tools (one-line errors for bad values)."""
from __future__ import annotations

import argparse


def rate(text):
    """A loss rate: 0.02 or 2%, in [0, 1)."""
    try:
        v = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"loss must be in [0, 1) or 0%..99%, got {text}")
    return v


def positive_int(text):
    """An integer of at least 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def window(text):
    """A worker's window (Worker(window=...)): "auto", "none" or a positive number of bytes."""
    text = text.strip().lower()
    if text == "auto":
        return "auto"
    if text in ("none", "off", ""):
        return None
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, none or a number of bytes, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"a window must be at least 1 byte, got {v}")
    return v
