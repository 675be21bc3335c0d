"""`pip install .` from the repository root: the Python binding, built by python/setup.py."""
import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "python", "setup.py"),
               run_name="__main__")
