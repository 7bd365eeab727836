"""Evaluation: what measures a model (docs/design.md §6, §7, §9); eval.py is its command line.

- ``retrieval``: encode a split (``EncodedSplit``) and score every (caption, image) pair exactly
- ``metrics``: R@K and ranks under CLIP_benchmark's protocol (ties count against the model)
- ``two_stage``: a split through the service's two-stage search (``rank_captions``, ``evaluate_split``)
- ``compositional``: the binding suite (true caption vs a minimally edited one, per edit type)
- ``partial``: queries naming one or two objects, scored against every image they are true of (P@k, nDCG, mAP)
- ``diagnostics``: attention entropy, Q/K spectra, head redundancy, logit range (also logged during training)
- ``plots``: recall-at-K curves; ``viz``: attention heatmaps and diagnostic curves (``python -m mmgeo.eval.viz``)

Importing this package imports none of them (nor torch); import the module you need.
"""
