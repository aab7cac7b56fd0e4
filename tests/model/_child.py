"""One save in its own process, SIGKILLed at a fault point by the test.

    python -m tests.model._child KIND ROOT SPEC_JSON STEP VID OVERWRITE

``ATOMIC_CHECKPOINT_FAULTS`` (set by the caller) names where the process kills itself
(``after_rename@0=kill:<step>``, ...). A save that never reaches the fault point (it
was refused, or the rotation had nothing to delete) ends normally and prints one JSON
line with its outcome; a killed one prints nothing.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    kind, root, spec_json, step_s, vid_s, overwrite_s = sys.argv[1:7]
    from tests.model.kinds import METRIC, make_state, metric_of, open_manager

    spec = tuple(
        (name, tuple(arg) if isinstance(arg, list) else arg) for name, arg in json.loads(spec_json)
    )
    step, vid, overwrite = int(step_s), int(vid_s), overwrite_s == "1"
    out: dict[str, object] = {"opened": False}
    try:
        mgr = open_manager(kind, root, spec)
    except Exception as exc:
        out.update(error=type(exc).__name__, message=str(exc))
        print(json.dumps(out), flush=True)
        return 0
    out["opened"] = True
    out["run_id"] = mgr.run_id
    try:
        mgr.save(step, make_state(vid, step), metrics={METRIC: metric_of(vid)}, overwrite=overwrite)
        out["saved"] = True
    except Exception as exc:
        out.update(saved=False, error=type(exc).__name__, message=str(exc))
    try:
        mgr.close()
    except Exception as exc:
        out.update(close_error=f"{type(exc).__name__}: {exc}")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
