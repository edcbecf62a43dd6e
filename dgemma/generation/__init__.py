"""The generation layer: tasks and their programs (programs.py, choose.py), the canvas loop, the drivers."""
