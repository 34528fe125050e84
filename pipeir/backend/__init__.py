"""Lowering: a Schedule -> one instruction program per rank, and Python code generation."""
