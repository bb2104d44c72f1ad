"""Mamba state pool and the ops that read and write it."""
NULL_SLOT = 0  # pool slot 0 is never handed to a request; padded rows point at it and ops skip it
