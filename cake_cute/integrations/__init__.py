"""Adapters that plug cake_cute into training frameworks through each framework's own extension points.

Each module here imports without its framework installed, and registers nothing then.
"""
