"""The data pipeline: `corpus` (preparation and the content-keyed token cache), `sources` (input
formats), `tokenize`, `sampling` (what workers read) and `synthetic` (the embedded default language).
Nothing is imported here, so that importing one part does not import the others."""
