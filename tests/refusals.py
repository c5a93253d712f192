"""gtp-train's command line, run in this one process for each of several argument lists:
`python tests/refusals.py JSON`, JSON a list of argument lists (each with its own out_dir),
prints as JSON each run's exit status and what it wrote to stderr. For refusals, which end
before any rank starts: one interpreter and one torch import for all of them, not one each."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback

from hydra.core.global_hydra import GlobalHydra

from gtp_wrap.app.train import main


def refused(args: list[str]) -> dict:
    """gtp-train's exit status and stderr for `args`. An exception that escapes `main` (Hydra
    re-raises its own under HYDRA_FULL_ERROR=1 or a tracer) is what a new interpreter would
    print before exiting with status 1."""
    sys.argv = ["gtp-train", *args]
    err = io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = e.code
        except Exception:  # noqa: BLE001 - reported as the command line would report it
            traceback.print_exc()
            code = 1
    GlobalHydra.instance().clear()
    return {"code": code, "stderr": err.getvalue()}


if __name__ == "__main__":
    print(json.dumps([refused(args) for args in json.loads(sys.argv[1])]))
