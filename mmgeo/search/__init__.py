"""Search over an image gallery, the one path used by the service (``serve``) and ``eval.py --mode two-stage``
(docs/design.md):

- ``faiss_index``: FAISS indexes over global vectors (built and searched only here)
- ``shards``: a FAISS index cut into memory-mapped shards, searched and merged
- ``store``: the on-disk gallery format and its reader, ``Gallery``; ``build``: its writers
- ``codecs``: how the re-rank store keeps keys/values (fp16, or FAISS SQ / PQ / RQ codes)
- ``two_stage``: FAISS top-K' then geometric re-rank (``search_texts``); evaluation runs every caption of a split
  through it in ``mmgeo.eval.two_stage``, which this package never imports
- ``database``: the gallery in PostgreSQL + pgvector (``DbGallery``: first stage and the candidates' codes in one
  SQL query, re-ranked as above; transactional writes, migrations); ``db_build``: its builders (the ``db`` extra)

Importing this package imports none of them (nor torch or faiss); import the module you need.
"""
