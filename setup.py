"""Build hook: the wheel carries the course files (notebooks with their solutions, in English and Korean; examples, images) under
labkit/course/, so that `labkit workspace DIR` can copy them out of a pip-only install. In the source tree they stay
at the top level, where students and reviewers find them; everything else is declared in pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

COURSE = {"notebooks": ("*.ipynb", "solutions/*.ipynb", "ko/*.ipynb", "ko/solutions/*.ipynb", "nbval_sanitize.cfg"), "examples": ("*.yaml",),
          "images": ("*.svg",)}


class BuildWithCourse(build_py):
    def run(self):
        super().run()
        here = Path(__file__).resolve().parent
        for folder, patterns in COURSE.items():
            for pattern in patterns:
                for source in sorted((here / folder).glob(pattern)):
                    target = Path(self.build_lib) / "labkit" / "course" / folder / source.relative_to(here / folder)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, target)


setup(cmdclass={"build_py": BuildWithCourse})
