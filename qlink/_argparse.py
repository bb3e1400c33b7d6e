"""The argument parser every qlink command line uses (``qlink``, ``scenarios/*.py``).

* an error is one line on stderr and exit status 2, never a usage block or a traceback;
* an unknown choice names the valid ones and the nearest match;
* an option that does not apply to the (sub)command is refused, naming the ones that do;
* ``--help`` shows every default and an ``examples:`` block;
* list options take ``5,7`` and ``5 7`` alike (:class:`ListAction`), checked by
  :mod:`qlink.checks`.

>>> from qlink import checks
>>> p = Parser(prog="demo", examples="demo --distances 5,7")
>>> _ = p.add_argument("--distances", action=ListAction, check=checks.distances, default=(5,))
>>> p.parse_args(["--distances", "5", "7"]).distances, p.parse_args(["--distances", "3,5"]).distances
((5, 7), (3, 5))
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from . import checks

__all__ = ["Parser", "ListAction", "CheckedAction", "checked", "typed", "run_main"]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown where they say something (not for None or a False switch); epilog kept as written."""

    def _get_help_string(self, action):
        h = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in h or not action.option_strings:
            return h
        d = action.default
        shown = ",".join(map(str, d)) if isinstance(d, (tuple, list)) else d
        return f"{h} (default: {shown})".strip()


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors, nearest-match hints, shown defaults,
    an ``examples`` epilog and no abbreviated options."""

    def __init__(self, *args, examples: str | None = None, **kw):
        kw.setdefault("formatter_class", _Formatter)
        kw.setdefault("allow_abbrev", False)
        d = kw.get("description")
        if d and "\n" not in d:  # kept as written (for the examples' sake), so wrapped here
            kw["description"] = textwrap.fill(d, 78)
        if examples:
            kw["epilog"] = "examples:\n" + "\n".join(f"  {ln}" for ln in examples.strip().splitlines())
        super().__init__(*args, **kw)
        self.set_defaults(_parser=self)

    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message)
        self.exit(2, f"{self.prog}: error: {message.strip()}\n")

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            hint = checks.nearest(str(value), choices)
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}; valid: {', '.join(choices)}"
                                                 f"{f' (did you mean {hint!r}?)' if hint else ''}")

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            where: Parser = getattr(ns, "_parser", self)
            opts = sorted({o for a in where._actions for o in a.option_strings if o.startswith("--")} - {"--help"})
            flag = next((x for x in extras if x.startswith("-")), extras[0])
            if flag.startswith("-"):
                name = flag.split("=", 1)[0]
                where.error(f"{name} does not apply to `{where.prog}`; its options: {', '.join(opts) or 'none'}")
            where.error(f"unexpected argument {flag!r} (see {where.prog} --help)")
        if hasattr(ns, "_parser"):
            delattr(ns, "_parser")
        return ns


class CheckedAction(argparse.Action):
    """Store ``check(value, where=<option>)``; a :class:`qlink.checks.UsageError` becomes a one-line error."""

    def __init__(self, *args, check, **kw):
        self.check = check
        super().__init__(*args, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, self.check(values, where=option_string or self.dest))
        except checks.UsageError as e:
            parser.error(str(e))


def checked(check, **options) -> dict:
    """``add_argument`` keywords that check a value with ``check(value, where=..., **options)``
    (one of :mod:`qlink.checks`) as it is parsed."""
    return dict(action=CheckedAction, check=lambda v, where: check(v, where=where, **options))


class ListAction(CheckedAction):
    """A list option: ``--x 5,7``, ``--x 5 7`` and ``--x "5, 7"`` are the same; ``check`` gets the words."""

    def __init__(self, *args, **kw):
        kw.setdefault("nargs", "+")
        super().__init__(*args, **kw)


def typed(check, **kw):
    """An argparse ``type=`` from a :mod:`qlink.checks` function (for positional arguments).

    >>> typed(checks.count)("3")
    3
    """
    def convert(text):
        try:
            return check(text, where="", **kw)
        except checks.UsageError as e:
            raise argparse.ArgumentTypeError(str(e).lstrip(": ").removeprefix(" ")) from None
    convert.__name__ = getattr(check, "__name__", "value")
    return convert


def run_main(main, argv=None) -> int:
    """Run ``main(argv)`` for a script: a :class:`qlink.checks.UsageError` (or ConfigError) is one line
    and exit 2; Ctrl-C is one line and exit 130.

    Run as a program (``argv`` None), the script runs as a worker under :mod:`qlink._supervise`,
    so SIGINT/SIGTERM end every process it started and exit 130/143.
    """
    import os

    from ._supervise import WORKER_ENV, become_worker, supervise
    from .errors import ConfigError

    prog = sys.argv[0].rsplit("/", 1)[-1]
    if os.environ.get(WORKER_ENV):
        become_worker()
    elif argv is None and sys.argv[0].endswith(".py") and os.path.isfile(sys.argv[0]):
        rc = supervise(sys.argv[1:], prog=prog, command=[sys.executable, os.path.abspath(sys.argv[0])])
        if rc >= 0:
            return rc
    try:
        return int(main(argv) or 0)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
