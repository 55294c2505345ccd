"""The length predictor at work: samples from live requests, online training in the background,
weights shared through the state store, and each request's belief about its remaining length.

    prefill / step   the worker reports the target's hidden state at the request's last committed
                     token (`Prefilled.features`, `StepResult.features`); `belief` turns it into
                     (μ, σ) of ln(remaining tokens), at no extra forward pass, and `note` keeps it
                     as a training sample at a few checkpoints of the request's progress;
    finish           the request's true length labels its samples (`finish`);
    background       every `refit_every` new samples a daemon thread refits
                     (`LengthPredictor.fit`, a closed-form solve, never inside a step), saves the
                     weights to the store under its name (newest version wins), and adopts a
                     newer version another replica saved.

Checkpoints (committed tokens 0, 16, 64, 256, 1024): a sample at every step would weight long
requests by their length and make the solve's statistics a per-step cost; a handful per request
covers how the error shrinks as a request progresses (what LAPS-SD's re-prediction reads).

Requests that ended at their token limit are censored (their true length is unknown, only that
it is at least the limit), so their samples are not kept: counting them as finished at the limit
would teach the predictor that requests are as short as clients' limits, and the limit is applied
at ranking time anyway (`mean_beyond(..., cap=max_tokens)`). Cancelled and failed requests teach
nothing either.

Restarts: the weights come back from the store (`load`), so predictions resume at once; the
sufficient statistics do not (they are O(d²), megabytes for a 576-wide model), so the next fit
waits for `min_samples` new samples and versions continue from the loaded one.
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence

from scheduler.length_predictor import LengthPredictor, PredictorWeights

log = logging.getLogger(__name__)

MODEL_NAME = "length_predictor"
CHECKPOINTS = (0, 16, 64, 256, 1024)

Belief = tuple[float, float, int]     # (μ, σ) of ln(remaining tokens), at `committed`


class LengthLearner:
    def __init__(self, store=None, *, name: str = MODEL_NAME, min_samples: int = 32,
                 refit_every: int = 16, ridge: float = 1.0, poll_s: float = 30.0) -> None:
        """`store`: a StateStore with `save_model`/`load_model` (None: weights stay in process);
        `name`: the weights' name there (one per target model: features are the model's own)."""
        self.store = store
        self.name = name
        self.min_samples = min_samples
        self.refit_every = refit_every
        self.ridge = ridge
        self.poll_s = poll_s
        self.weights: PredictorWeights | None = None
        self._predictor: LengthPredictor | None = None   # made when the first features arrive
        self._pending: dict[str, list[tuple[tuple[float, ...], int]]] = {}   # rid -> samples
        self._new = 0                                    # samples observed since the last fit
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def samples(self) -> int:
        """Labelled samples observed in this process."""
        p = self._predictor
        return 0 if p is None else p.samples

    # ---- the step loop's thread -----------------------------------------------------------------
    def belief(self, features: Sequence[float] | None, committed: int) -> Belief | None:
        """(μ, σ, committed) for a request whose last committed token (`committed` tokens into its
        output) gave `features`; None before any weights or without features."""
        w = self.weights
        if w is None or features is None or len(features) != w.dim:
            return None
        return (w.log_mean(features, committed), w.sigma, committed)

    def note(self, request_id: str, features: Sequence[float] | None, committed: int) -> None:
        """Keep `features` as a sample of the request if it has reached its next checkpoint."""
        if features is None:
            return
        samples = self._pending.setdefault(request_id, [])
        done = len(samples)
        if done < len(CHECKPOINTS) and committed >= CHECKPOINTS[done]:
            samples.append((tuple(features), committed))

    def finish(self, request_id: str, length: int, *, labelled: bool) -> None:
        """The request ended with `length` output tokens; `labelled`: it ended on its own (a stop
        token or string), so the length is its true one and its samples are kept."""
        samples = self._pending.pop(request_id, None)
        if not samples or not labelled:
            return
        with self._lock:
            if self._predictor is None:
                self._predictor = LengthPredictor(len(samples[0][0]), ridge=self.ridge,
                                                  min_samples=self.min_samples)
                if self.weights is not None:
                    self._predictor.version_from(self.weights.version)
            p = self._predictor
        kept = 0
        for features, c in samples:
            if length > c and len(features) == p.dim:
                p.observe(features, c, length - c)
                kept += 1
        with self._lock:
            self._new += kept
            if self._new >= self.refit_every:
                self._wake.set()

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    # ---- any thread -----------------------------------------------------------------------------
    def load(self) -> PredictorWeights | None:
        """Adopt the store's weights if they are newer than ours (another replica's, or ours
        from before a restart)."""
        if self.store is None:
            return self.weights
        doc = self.store.load_model(self.name)
        if doc is not None:
            w = PredictorWeights.from_dict(doc)
            with self._lock:
                if self.weights is None or w.version > self.weights.version:
                    self.weights = w
                    if self._predictor is not None:
                        self._predictor.version_from(w.version)
        return self.weights

    def refit(self) -> PredictorWeights | None:
        """Fit on every sample so far, adopt and save the result (None: too few samples)."""
        with self._lock:
            p, self._new = self._predictor, 0
        w = p.fit() if p is not None else None
        if w is None:
            return None
        with self._lock:
            if self.weights is None or w.version > self.weights.version:
                self.weights = w
        if self.store is not None:
            self.store.save_model(self.name, w.to_dict())
        return w

    def start(self) -> None:
        """Load the stored weights, then refit in a daemon thread as samples arrive."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="specgate-length-learner",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.load()
                if self._new >= self.refit_every:
                    self.refit()
            except Exception:          # a store that is down: keep the weights we have
                log.warning("length predictor: refit or store call failed", exc_info=True)
            self._wake.wait(self.poll_s)
            self._wake.clear()
