"""Wrong: dereferences a null pointer, killing its process with SIGSEGV."""
import ctypes


def tail_forward(h, idx, w, bias):
    return ctypes.string_at(0)
