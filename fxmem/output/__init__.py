"""The report as text, markdown, CSV, JSON and pictures; nothing here prints.

Read ``render.render`` first.
"""
