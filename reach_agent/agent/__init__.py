"""The agent runtime: ``Agent`` and how it announces, admits, claims, runs and answers tasks."""
