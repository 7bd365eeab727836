"""mmgeo search service: ``python -m serve build ...`` then ``python -m serve run --index DIR``."""
