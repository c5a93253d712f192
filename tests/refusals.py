"""gtp-train's command line run in this one process for each of several override lists, as
`python tests/refusals.py OUT_DIR JSON` where JSON is a list of argument lists: prints, as JSON,
each run's exit status and what it wrote to stderr. For refusals, which end before any rank
starts: one interpreter and one torch import for all of them, not one each."""

from __future__ import annotations

import contextlib
import io
import json
import sys

from hydra.core.global_hydra import GlobalHydra

from gtp_wrap.app.train import main


def refused(args: list[str]) -> dict:
    """gtp-train's exit status and stderr for `args`."""
    sys.argv = ["gtp-train", *args]
    err = io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = e.code
    GlobalHydra.instance().clear()
    return {"code": code, "stderr": err.getvalue()}


if __name__ == "__main__":
    print(json.dumps([refused(args) for args in json.loads(sys.argv[1])]))
