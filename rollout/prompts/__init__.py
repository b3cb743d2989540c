"""Prompt sets as users keep them (each path read as a row of PROMPT_FORMATS, formats.py), their rows
made into records, and the resumable prompt stream the driver draws from."""
