"""Checks run by hand across commits: `same_numbers` (a restructuring changes no number)."""
