"""Shared fixtures: ``gallery_env`` (a tiny model and a gallery of 24 synthetic test images) from
``tests.search.conftest``, with FAISS on one thread."""

from tests.search.conftest import gallery_env, ranked, single_thread_faiss  # noqa: F401 (fixtures, one autouse)
