"""Multi-level queues by attained service, with geometrically growing quanta.

Level k holds requests whose attained service a (tree tokens verified) lies in [T(k−1), T(k)),
with T(k) = first_quantum · growth^k and T(−1) = 0; the last level holds everything above.
So the quantum a request spends in level k ≥ 1 is first_quantum · growth^(k−1) · (growth − 1).

>>> lv = Levels(n_levels=4, first_quantum=32, growth=4)
>>> [lv.level_of(a) for a in (0, 31, 32, 127, 128, 511, 512, 10**6)]
[0, 0, 1, 1, 2, 2, 3, 3]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Levels:
    n_levels: int = 6
    first_quantum: float = 32.0
    growth: float = 4.0

    thresholds: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n_levels < 1 or self.first_quantum <= 0 or self.growth <= 1:
            raise ValueError("need n_levels ≥ 1, first_quantum > 0, growth > 1")
        ts = tuple(self.first_quantum * self.growth ** k for k in range(self.n_levels - 1))
        object.__setattr__(self, "thresholds", ts + (math.inf,))

    def level_of(self, attained: float, start: int = 0) -> int:
        """The level for `attained`; `start` (a level the request already reached) is a hint:
        attained service never decreases, so the search goes down from there."""
        ts, k = self.thresholds, start
        while attained >= ts[k]:
            k += 1
        return k

    def threshold(self, level: int) -> float:
        """Attained service at which a request leaves `level` (inf for the last level)."""
        return self.thresholds[min(level, self.n_levels - 1)]
