"""The trainer's side of in-run evaluation: version v+1 is not published (nor the trainer's exit taken after
the last version) until version v's evaluation is recorded, when v is one the run evaluates.

Why: the evaluation shares the engines with rollout (`pipeline.eval.inrun`), and a publication replaces their
weights. Holding the next publication is what makes an evaluation run on exactly the version it names, and
what lets a rollout stage killed mid-evaluation redo it on restart (the engines still serve that version).
The hold costs training nothing while an evaluation is shorter than a training step; the time it does cost is
the `time_eval_hold_s` of the step's metrics row. It ends at `eval.hold_timeout_s`: the trainer then publishes
anyway, and the evaluation, finding other weights under its tokens, records nothing for that version.
"""

from __future__ import annotations

import logging
import time

from pipeline.eval.results import is_recorded
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig

log = logging.getLogger("arl.eval")

_POLL_S = 0.1


def evaluated(paths: RunPaths, config: ArlConfig, version: int) -> bool:
    """Whether every eval set of `version` is recorded."""
    return all(is_recorded(paths, version, spec.name) for spec in config.eval.sets)


def hold_for_evaluation(paths: RunPaths, config: ArlConfig, version: int) -> float:
    """Wait (within `eval.hold_timeout_s`) until `version`'s evaluation is recorded, if the run evaluates that
    version during the run; the seconds waited."""
    if version not in config.eval.versions(config.num_steps) or evaluated(paths, config, version):
        return 0.0
    started = time.monotonic()
    timeout = config.eval.hold_timeout_s
    log.info("waiting for the evaluation of version %d before going on (eval.hold_timeout_s=%.0f)", version, timeout)
    while not evaluated(paths, config, version):
        if time.monotonic() - started > timeout:
            missing = [s.name for s in config.eval.sets if not is_recorded(paths, version, s.name)]
            log.warning(
                "the evaluation of version %d is not recorded after eval.hold_timeout_s=%.0fs (sets %s; "
                "see logs/rollout/): going on without it; `arl eval RUN_DIR --step %d` evaluates the "
                "checkpoint offline if it is kept",
                version,
                timeout,
                ", ".join(missing),
                version,
            )
            break
        time.sleep(_POLL_S)
    return time.monotonic() - started
