"""Speculative decoding: drafters and rejection sampling."""
