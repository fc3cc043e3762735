"""The public name of :mod:`dlrover_hpc.worker.progress`: what a training script calls.

``dlrover_hpc.progress.step(n)`` reports progress, ``with dlrover_hpc.progress.section("eval"):``
marks a long phase, ``dlrover_hpc.progress.stop_requested()`` polls for a stop at a step.
"""

from dlrover_hpc.worker.progress import (
    StopNotice,
    current,
    enter_section,
    leave_section,
    mark_stopped,
    section,
    sectioned,
    step,
    stop_requested,
)

__all__ = [
    "StopNotice",
    "current",
    "enter_section",
    "leave_section",
    "mark_stopped",
    "section",
    "sectioned",
    "step",
    "stop_requested",
]
