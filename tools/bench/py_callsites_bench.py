"""Cost per call of MAGI_PY_CALLSITES: a Python program calls ncclAllReduce through ctypes,
traced: holding the GIL (PyDLL) with the option 0 and 1, and with the GIL released (CDLL, as
PyTorch's bindings do) with the option 0 and 2 (which takes the GIL back for the walk).

  python3 tools/bench/py_callsites_bench.py BUILD [CALLS]

BUILD holds libmagice.so and tests/support/libnccl.so.2 (the stand-in, one rank). Prints the
time per call of each setting (best of 5 runs) and the difference. The calls are made a few
frames deep, from functions of this file, as a training loop's are.
"""
import ctypes
import os
import subprocess
import sys
import tempfile
import time


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def child(build, calls, gil):
    kind = ctypes.PyDLL if gil == "held" else ctypes.CDLL
    held = ctypes.PyDLL(os.path.join(build, "libmagice.so"))
    caller = kind(os.path.join(build, "libmagice.so"))
    uid = UniqueId()
    standin = ctypes.PyDLL(os.path.join(build, "tests/support/libnccl.so.2"))
    assert standin.ncclGetUniqueId(ctypes.byref(uid)) == 0
    comm = ctypes.c_void_p()
    assert held.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
    send, recv = (ctypes.c_float * 16)(), (ctypes.c_float * 16)()
    count = ctypes.c_size_t(16)
    reduce = caller.ncclAllReduce

    def layer():
        return reduce(send, recv, count, 7, 0, comm, None)

    def step():
        for _ in range(calls):
            layer()

    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    held.ncclCommDestroy(comm)
    print(best / calls * 1e9)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    build = os.path.abspath(sys.argv[1])
    calls = sys.argv[2] if len(sys.argv) > 2 else "20000"
    for gil, on in (("held", "1"), ("released", "2")):
        results = {}
        for setting in ("0", on):
            with tempfile.TemporaryDirectory() as traces:
                env = dict(os.environ, MAGI_PY_CALLSITES=setting, MAGI_TRACE_DIR=traces,
                           MAGI_NCCL_LIBRARY=os.path.join(build, "tests/support/libnccl.so.2"))
                out = subprocess.run([sys.executable, __file__, "--child", build, calls, gil],
                                     env=env, check=True, capture_output=True, text=True).stdout
                results[setting] = float(out.split()[-1])
                print(f"GIL {gil}, MAGI_PY_CALLSITES={setting}: {results[setting]:.0f} ns per call")
        print(f"GIL {gil}: added {results[on] - results['0']:.0f} ns per call")

if __name__ == "__main__":
    main()
