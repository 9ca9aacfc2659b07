"""Opt-in integrations with training libraries that work around ZeRO-3 problems the fork fixes.

Each is imported explicitly (``from zero3_ac.integrations.trl import ...``); importing ``zero3_ac``
imports none of them.
"""
