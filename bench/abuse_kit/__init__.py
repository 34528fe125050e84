"""The pieces of bench/abuse.py."""
