"""Every format a verdict is written in: the terminal's (terminal.py, with the text rules of text.py), JSON
(json_report.py), JUnit XML (junit.py), Markdown (markdown.py), the error plot (plot.py) and GitHub Actions'
annotation (github.py).
Each is a function of a finished Report; cli/outputs.py (FORMATS) is the one place that chooses among them.
"""
