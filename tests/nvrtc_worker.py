"""A process that compiles through NVRTC, as cuDNN's first attention call does (tests/test_stops.py),
while a thread watches which handler holds SIGTERM: NVRTC's first compile in a process puts its
own in place, which ends the process with exit code 4, or hangs it (it allocates memory inside the
signal handler), where a stop signal arrives then. The thread only looks; no signal is sent
during the compile.

    python tests/nvrtc_worker.py NVRTC_DIR bare|script|train

bare: Python's handler alone, the process exits 0 after the compile; script: inside
scripts/stopping.py's stoppable; train: inside trainer/signals.py's StopSignals, each then sent
SIGTERM, which stops it as the mode's handler does (exit 143). Prints `NVRTC held SIGTERM` if the
thread saw another handler in place during the compile, then `compiled`."""

import ctypes
import glob
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LIBC = ctypes.CDLL(None)


class SigAction(ctypes.Structure):  # glibc's struct sigaction on x86-64
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]


def sigterm_action() -> int | None:
    action = SigAction()
    LIBC.sigaction(signal.SIGTERM, None, ctypes.byref(action))
    return action.handler


def watch(ours: int | None, done: threading.Event) -> None:
    while not done.is_set():
        if sigterm_action() != ours:
            print("NVRTC held SIGTERM", flush=True)
            return
        time.sleep(0.0005)


def compile_like_cudnn(nvrtc) -> None:
    """A program of some size for sm_90, long enough that the thread sees NVRTC's handler if it comes."""
    body = "".join(f"a = a * y[{i % 31}] + {i}.5f; " for i in range(300))
    source = f'extern "C" __global__ void k(float *y) {{ float a = y[threadIdx.x]; {body} y[0] = a; }}'.encode()
    program = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"k.cu", 0, None, None) == 0
    assert nvrtc.nvrtcCompileProgram(program, 1, (ctypes.c_char_p * 1)(b"--gpu-architecture=sm_90")) == 0
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def main() -> None:
    lib_dir, mode = sys.argv[1], sys.argv[2]
    for pattern in ("libnvrtc-builtins.so.*[0-9]", "libnvrtc.so.*[0-9]"):  # as torch's CUDA wheels load them
        nvrtc = ctypes.CDLL(sorted(glob.glob(os.path.join(lib_dir, pattern)))[0])

    def run() -> None:
        done = threading.Event()
        watcher = threading.Thread(target=watch, args=(sigterm_action(), done), daemon=True)
        watcher.start()
        compile_like_cudnn(nvrtc)
        done.set()
        watcher.join()
        print("compiled", flush=True)

    if mode == "bare":
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        run()
        return
    if mode == "script":
        from scripts.stopping import stoppable
        with stoppable("nvrtc_worker.py", lambda: "nothing kept"):
            run()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
    else:
        from trainer.signals import StopSignals
        with StopSignals() as stop:
            run()
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 60
            while not stop.received and time.monotonic() < deadline:
                time.sleep(0.01)
        sys.exit(128 + stop.received)


if __name__ == "__main__":
    main()
