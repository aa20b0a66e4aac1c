"""Adapters for serving engines."""
