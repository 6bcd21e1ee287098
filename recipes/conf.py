# Sphinx configuration of the recipes pages. Built with warnings as errors:
#   .venv/bin/python -m sphinx -W -b html recipes /tmp/recipes-html
# (tests/recipes/test_pages.py does exactly this).
project = "kvtier recipes"
author = "kvtier"
root_doc = "index"
extensions = ["sphinx_design"]  # tab-set: one tab per engine on every recipe page
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = "kvtier recipes"
