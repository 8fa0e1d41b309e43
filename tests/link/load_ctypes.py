"""load_ctypes.py: libebb.so loads into Debian's python3 through ctypes.

This is the path a Python training stack takes. It breaks when libebb depends on a library
built with initial-exec TLS (Debian's jemalloc): "cannot allocate memory in static TLS block".
usage: python3 load_ctypes.py /path/to/libebb.so   (exit 0 ok, 1 failure, 77 skipped)
"""
import sys

try:
    import ctypes
except ImportError as e:  # a python3 built without ctypes: nothing to test
    print(f"SKIP: python3 has no ctypes ({e})")
    sys.exit(77)


def main(path: str) -> int:
    lib = ctypes.CDLL(path)
    lib.ebb_init.restype = ctypes.c_int
    lib.ebb_shutdown.restype = ctypes.c_int
    lib.ebb_last_error.restype = ctypes.c_char_p
    lib.ebb_dev_count.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.ebb_dev_count.restype = ctypes.c_int

    st = lib.ebb_init()
    if st != 0:
        print(f"ebb_init returned {st}: {lib.ebb_last_error().decode(errors='replace')}")
        return 1
    n = ctypes.c_int(0)
    st = lib.ebb_dev_count(ctypes.byref(n))
    if st != 0 or n.value < 1:
        print(f"ebb_dev_count returned {st} with {n.value} devices")
        lib.ebb_shutdown()
        return 1
    st = lib.ebb_shutdown()
    if st != 0:
        print(f"ebb_shutdown returned {st}: {lib.ebb_last_error().decode(errors='replace')}")
        return 1
    print(f"ok: {n.value} devices")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: load_ctypes.py /path/to/libebb.so")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
