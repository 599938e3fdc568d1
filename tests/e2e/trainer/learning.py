"""Did a run learn? Mean rewards against the noise of a policy that does not.

A step's mean reward over R responses with rewards in [0, 1] and mean p has sampling variance at most p(1-p)/R
(the Bernoulli case is the largest), so the mean of k steps has standard deviation at most sqrt(p(1-p)/(kR)).
That treats the responses as independent, though a group's n responses share a prompt. The recorded curves of the
main job say the model holds there: their step-to-step scatter is below this bound
(``test_end_to_end.py::test_the_noise_model_holds_on_the_recorded_curves``). A run *learned* when the mean of its
last steps exceeds the mean of its first steps by more than ``sigmas`` standard deviations of that difference
for a policy that stayed at the first steps' mean (no fewer than 3).
"""

from __future__ import annotations

import math
import statistics


def sampling_sd(mean: float, steps: int, responses_per_step: int) -> float:
    """Upper bound on the standard deviation of the mean reward of ``steps`` steps, from sampling alone."""
    p = min(max(mean, 1.0 / responses_per_step), 1.0 - 1.0 / responses_per_step)  # never a zero-width null
    return math.sqrt(p * (1 - p) / (steps * responses_per_step))


def rose_beyond_noise(scores: list[float], *, first: int, last: int, responses_per_step: int,
                      sigmas: float = 3.0) -> tuple[bool, str]:
    """(learned, how): the last ``last`` steps' mean reward against the first ``first`` steps'."""
    if sigmas < 3:
        raise ValueError(f"a learning check needs at least 3 standard deviations of the no-learning noise, got {sigmas}")
    before, after = statistics.fmean(scores[:first]), statistics.fmean(scores[-last:])
    noise = math.hypot(sampling_sd(before, first, responses_per_step), sampling_sd(before, last, responses_per_step))
    rose = after - before > sigmas * noise
    return rose, (f"first {first} steps {before:.3f}, last {last} {after:.3f}: rise {after - before:+.3f} against "
                  f"{sigmas:g} sd = {sigmas * noise:.3f} of a policy that does not learn; curve {scores}")
