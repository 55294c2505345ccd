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
covers how the error changes as a request progresses (what LAPS-SD's re-prediction reads).

Calibrated uncertainty: σ of a belief is the predictor's out-of-sample error at that checkpoint,
measured on finished requests against the weights of the time (prequential: each sample is
scored before it is learned from), not the fit's in-sample spread. It need not shrink as a request
runs: on the default model `bench lengths` measured the error at 32-128 tokens above the one at
arrival (whether an answer will loop to its limit shows late), so a belief replaces a request's
earlier one only when it is at least as precise (`better`).

Requests that ended at their token limit are censored: their true length is unknown, only that
it is at least the limit. Dropping them would teach the predictor only from requests that stopped
early (on the default model about half of the load test's answers run to a 512-token limit), so
that everything looks short; counting them as finished at the limit would teach that requests are
as short as clients' limits (a client asking for 8 tokens). So a censored sample teaches only
when it is news: when the current weights predicted less than the limit, the request showed it
is at least that long, and it counts at the limit; when they predicted more, it is consistent
with them and is left out (a one-step approximation of censored regression). Cancelled and
failed requests teach nothing.

Restarts: the weights come back from the store (`load`), so predictions resume at once; the
sufficient statistics do not (they are O(d²), megabytes for a 576-wide model), so the next fit
waits for `min_samples` new samples and versions continue from the loaded one.

Cold start: weights shipped for a model (`shipped_predictor`: `scheduler/predictors/<model>.json`,
written by `specgate bench lengths --save-weights`, trained on prompts the load tests do not
send) predict from the first request, and are the prior every online fit is pulled towards
(length_predictor.py). A model without shipped weights predicts nothing until its first fit;
the policies fall back to tenant records, then max_tokens.
"""
from __future__ import annotations

import json
import logging
import math
import threading
from importlib import resources
from typing import Sequence

from scheduler.length_predictor import LengthPredictor, PredictorWeights
from scheduler.request import RequestStats

log = logging.getLogger(__name__)

MODEL_NAME = "length_predictor"
CHECKPOINTS = (0, 16, 64, 256, 1024)

MIN_ERRORS = 10                       # scored requests before a checkpoint's own σ is used
ERROR_DECAY = 0.99                    # forgetting of old errors: ~100 requests' memory

Belief = tuple[float, float, int]     # (μ, σ) of ln(remaining tokens), at `committed`


def checkpoint(committed: int) -> int:
    """The index in CHECKPOINTS of the checkpoint at or before `committed`."""
    return max(i for i, c in enumerate(CHECKPOINTS) if c <= committed)


def better(new: Belief | None, old: Belief | None) -> bool:
    """Should `new` replace a request's `old` belief? When it is at least as precise: an earlier,
    sharper belief conditioned on how far the request has come since (`mean_beyond`) says more
    than a vaguer new one."""
    return new is not None and (old is None or new[1] <= old[1])


def shipped_predictor(model: str) -> tuple[PredictorWeights, float] | None:
    """The weights shipped for `model` (a model name, e.g. "smollm2-135m") and the ridge they
    were fitted with (online fits use it too), or None."""
    path = resources.files("scheduler").joinpath("predictors", f"{model}.json")
    if not path.is_file():
        return None
    doc = json.loads(path.read_text(encoding="utf-8"))
    return PredictorWeights.from_dict(doc), float(doc["ridge"])


class LengthLearner:
    def __init__(self, store=None, *, name: str = MODEL_NAME, min_samples: int = 32,
                 refit_every: int = 16, ridge: float = 1.0, poll_s: float = 30.0,
                 initial: PredictorWeights | None = None) -> None:
        """`store`: a StateStore with `save_model`/`load_model` (None: weights stay in process);
        `name`: the weights' name there (one per target model: features are the model's own);
        `initial`: weights to predict with until better ones exist, and the fits' prior."""
        self.store = store
        self.name = name
        self.initial = initial
        self.min_samples = min_samples
        self.refit_every = refit_every
        self.ridge = ridge
        self.poll_s = poll_s
        self.weights: PredictorWeights | None = initial
        self._predictor: LengthPredictor | None = None   # made when the first features arrive
        self._pending: dict[str, list[tuple[tuple[float, ...], int]]] = {}   # rid -> samples
        self._new = 0                                    # samples observed since the last fit
        # per checkpoint: decayed mean of squared out-of-sample errors of ln(remaining), weight
        self._sq = [0.0] * len(CHECKPOINTS)
        self._sq_n = [0.0] * len(CHECKPOINTS)
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
        return (w.log_mean(features, committed), self.sigma_at(committed), committed)

    def sigma_at(self, committed: int) -> float:
        """The out-of-sample error of ln(remaining) at the checkpoint at or before `committed`
        (the fit's own σ until `MIN_ERRORS` requests have been scored there)."""
        k = checkpoint(committed)
        if self._sq_n[k] >= MIN_ERRORS:
            return max(0.05, math.sqrt(self._sq[k] / self._sq_n[k]))
        return self.weights.sigma if self.weights is not None else 1.0

    def note(self, request_id: str, features: Sequence[float] | None, committed: int) -> None:
        """Keep `features` as a sample of the request if it has reached its next checkpoint."""
        if features is None:
            return
        samples = self._pending.setdefault(request_id, [])
        # one sample per checkpoint reached: a request re-admitted far into its output (or a step
        # that commits past several checkpoints) starts at the checkpoint it is at
        if not samples or checkpoint(committed) > checkpoint(samples[-1][1]):
            samples.append((tuple(features), committed))

    def predict(self, s: RequestStats, features: Sequence[float], committed: int) -> None:
        """Re-predict a request's remaining length from the features of its last committed token
        (`committed` tokens into its output), keeping them as a sample (`note`). Its belief is
        replaced only by a better one (`better`); before its first step it also gets a length
        predicted at arrival (`RequestStats.predicted_len`, what sjf ranks by)."""
        self.note(s.request_id, features, committed)
        belief = self.belief(features, committed)
        if not better(belief, s.length_belief):
            return
        s.length_belief = belief
        if s.predicted_len is None and s.n_steps == 0:
            mu, sigma, _ = belief
            s.predicted_len = committed + max(1, round(math.exp(mu + sigma * sigma / 2)))

    def finish(self, request_id: str, length: int, *, censored: bool = False) -> None:
        """The request ended with `length` output tokens: on its own (a stop token or string), or
        `censored` by its token limit (then its length is a lower bound: module docstring)."""
        samples = self._pending.pop(request_id, None)
        if not samples:
            return
        w = self.weights
        if censored:
            samples = [(f, c) for f, c in samples
                       if w is None or len(f) != w.dim or w.log_mean(f, c) < math.log(max(1, length - c))]
            if not samples:
                return
        elif w is not None:                      # score the weights before learning from it
            for f, c in samples:
                if length > c and len(f) == w.dim:
                    k = checkpoint(c)
                    err = math.log(length - c) - w.log_mean(f, c)
                    self._sq[k] = ERROR_DECAY * self._sq[k] + err * err
                    self._sq_n[k] = ERROR_DECAY * self._sq_n[k] + 1.0
        with self._lock:
            if self._predictor is None:
                dim, prior = len(samples[0][0]), self.initial
                self._predictor = LengthPredictor(
                    dim, ridge=self.ridge, min_samples=self.min_samples,
                    prior=prior if prior is not None and prior.dim == dim else None)
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
