"""Another job on the GPU: take GPU memory and hold it until killed (FM-17 on real hardware).

    python -m omnid.demo.gpu_hog all        # every free byte of GPU 0 but the last ~64 MiB
    python -m omnid.demo.gpu_hog 8192       # 8 GiB of GPU 0

It talks to the CUDA driver directly (libcuda through ctypes, no torch), so it holds memory
within a fraction of a second of starting. It prints one line, ``holding <MiB> free <MiB>``,
and says ``READY=1`` when run as a ``ready = "notify"`` unit, then waits for a signal. The GPU
is the first one CUDA sees (``CUDA_VISIBLE_DEVICES`` selects it; omnid sets that from a
unit's ``gpus``). Exit status 2 with a message when there is no CUDA driver or GPU.
"""

from __future__ import annotations

import ctypes
import signal
import sys

from omnid.demo.sdnotify import Notifier

_CHUNKS_ALL = (1 << 30, 64 << 20)  # greedy: 1 GiB blocks, then 64 MiB blocks until refused


class CudaError(Exception):
    pass


def _check(result: int, call: str) -> None:
    if result != 0:
        raise CudaError(f"{call} failed: CUresult {result}")


def take(amount: str) -> tuple[int, int]:
    """Allocate on CUDA device 0; returns (MiB held, MiB still free). The memory is held
    until the process exits (nothing here frees it)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise CudaError(f"no CUDA driver: {err}") from err
    _check(cuda.cuInit(0), "cuInit")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    _check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    held = 0
    if amount == "all":
        for size in _CHUNKS_ALL:
            while cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(size)) == 0:
                held += size
    else:
        size = int(amount) << 20
        _check(cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(size)), "cuMemAlloc_v2")
        held = size
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    return held >> 20, free.value >> 20


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (argv[0] == "all" or (argv[0].isdigit() and int(argv[0]) > 0)):
        print("usage: python -m omnid.demo.gpu_hog all|MIB", file=sys.stderr)
        return 2
    try:
        held, free = take(argv[0])
    except CudaError as err:
        print(f"gpu_hog: {err}", file=sys.stderr)
        return 2
    print(f"holding {held} free {free}", flush=True)
    Notifier.from_env().ready(f"holding {held} MiB")
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
