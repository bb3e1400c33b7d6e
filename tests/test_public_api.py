"""The public API is what the packages' ``__all__`` export: every name exists, is documented,
and nothing private leaks."""

import importlib
import subprocess
import sys

import pytest

PACKAGES = ["qlink", "transports", "qlink.qec", "qlink.qec.decoders", "qlink.qec.cudaq_config",
            "qlink.qec.cudaq_realtime", "qlink.qec.hotpath", "qlink.bench.cudaq_peer", "qlink.bench.dsparse", "qlink.bench.decoders", "qlink.ai",
            "qlink.wire", "qlink.budget", "qlink.links", "qlink.histogram", "qlink.clock", "qlink.memory", "qlink.errors",
            "qlink.checks", "qlink.bench.conditions", "qlink.doctor", "qlink.procs", "qlink.ai.peer", "qlink.ai.frames",
            "qlink.bench.report", "transports.framing", "transports.cuda", "qlink.reliability.soak",
            "qlink.reliability.faults", "qlink.reliability.crash", "qlink.reliability.fuzz", "qlink.sweep.cli",
            "qlink.fabric", "qlink.access",
            "qlink.qec.sessions", "qlink.bench.hostile"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_exist_and_are_documented(name):
    mod = importlib.import_module(name)
    assert mod.__doc__ and mod.__doc__.strip(), f"{name} has no module docstring"
    exported = mod.__all__
    assert len(exported) == len(set(exported)), f"{name}.__all__ repeats a name"
    for attr in exported:
        assert not attr.startswith("_") or attr == "__version__", f"{name} exports private name {attr}"
        obj = getattr(mod, attr)  # raises if missing
        if callable(obj) and not isinstance(obj, type(sys)):
            assert getattr(obj, "__doc__", None), f"{name}.{attr} has no docstring"


def test_every_error_is_a_qlink_error():
    import qlink

    for attr in qlink.__all__:
        obj = getattr(qlink, attr)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, qlink.QlinkError)


def test_importing_qlink_does_not_import_heavy_stacks():
    code = ("import sys, qlink, transports, qlink.qec, qlink.ai; "
            "heavy = [m for m in ('cudaq', 'cudaq_qec', 'ucxx', 'nixl_cu12', 'cupy', 'torch') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing qlink pulled in {out.stdout.strip()}"


def test_cli_info_and_help_run():
    out = subprocess.run([sys.executable, "-m", "qlink.cli", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pymatching" in out.stdout and "shm ring accelerator" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "qlink.cli", "bench", "nonsense"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
