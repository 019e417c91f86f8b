"""Interoperability: transformers import/export."""
