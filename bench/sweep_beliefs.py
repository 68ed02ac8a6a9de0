"""What an adaptive controller believed at the end of a controller-sweep point (bench/controller_sweep.py):
its prices and acceptance at the point's batch size, and where its price of a plain decode step came from."""
from __future__ import annotations

from typing import Any

from specserve.spec.adaptive import AdaptiveController
from specserve.spec.estimators import batch_bucket


def controller_beliefs(ctrl: AdaptiveController, c: int) -> dict[str, Any]:
    """What the adaptive controller believed at the end of a point, at batch c (why it chose its k):
    predicted step seconds and tokens/s per k, which k it priced on its own measurements there, the
    acceptance and fill per position, the calibration of drafts per request at this batch size (what
    drafting got over what acceptance and fill predicted), its catch-up pricing and the exploration
    budget spent."""
    est = ctrl.estimate(c)
    costs = ctrl.costs
    return {"best_k": est.best_k, "step_ms": [round(t * 1e3, 4) for t in est.step_seconds],
            "propose_ms": [round(t * 1e3, 4) for t in est.propose_seconds],
            "tokens_per_s": [round(r, 1) for r in est.tokens_per_s], "trusted": list(est.trusted),
            "decode_trusted": est.decode_trusted, "acceptance": [round(a, 3) for a in est.acceptance_per_pos],
            "fill": [round(f, 3) for f in est.fill_per_pos],
            "calibration": round(ctrl.calibration.ratio(batch_bucket(c)), 3), "cold_extra": costs.cold_extra,
            "decode_age": costs.decode_age(c), "samples": [costs.samples(c, k) for k in range(1, ctrl.max_k + 1)],
            "exploration_loss_s": round(ctrl.exploration_loss_seconds, 5),
            "observed_s": round(ctrl.observed_seconds, 4), "num_observed": costs.num_observed,
            "decode_price": decode_price(costs, c)}


def decode_price(costs: Any, c: int) -> dict[str, Any]:
    """Where the price of a plain decode step at batch c can come from (StepCosts.decode_seconds takes
    the first that has data): this bucket's own fit, the decode fit over every batch size, the verify
    fit; ms, and the decayed count of clean decode steps that decides between the last two (nineteenth
    session: the pair's controller priced k = 0 at 4.76 ms at c = 32, where a decode step took 1.92)."""
    x = (1.0, float(c), 0.0)
    local = costs.local_cost.get(c, 0)  # key 0: plain decode steps (estimators._DECODE)

    def ms(fit: Any) -> float | None:
        t = fit.predict_many([x]) if fit is not None else None
        return None if t is None else round(t[0] * 1e3, 4)

    return {"local_ms": None if local is None else round(local.predict(x) * 1e3, 4),
            "local_weight": None if local is None else round(local.weight, 2),
            "pooled_decode_ms": ms(costs.decode_cost), "verify_fit_ms": ms(costs.verify_cost),
            "pure_decode_weight": round(costs.pure_decode_weight, 3)}
