"""Training callbacks outside a Trainer: the attention diagnostics' grace period."""

import types
import warnings

from mmgeo.data import ShapesWorld
from mmgeo.training.callbacks import AttentionDiagnostics


def test_diagnostic_warnings_wait_for_the_grace_period(tiny_model):
    """At initialisation attention is near-uniform by construction: no warning before grace_steps."""
    cb = AttentionDiagnostics(ShapesWorld("val", image_size=32, size=4), every_n_steps=1, grace_steps=5)
    module = types.SimpleNamespace(model=tiny_model)
    with warnings.catch_warnings(record=True) as early:
        warnings.simplefilter("always")
        cb._run(types.SimpleNamespace(global_step=1, logger=None), module)
    assert not [x for x in early if "step 1" in str(x.message)]
    with warnings.catch_warnings(record=True) as late:
        warnings.simplefilter("always")
        cb._run(types.SimpleNamespace(global_step=5, logger=None), module)
    assert any("near-uniform" in str(x.message) for x in late)  # an untrained model attends uniformly
