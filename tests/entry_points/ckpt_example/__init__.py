"""An example of a team's pipeline package, named by specs' entry points in the tests
(``pipeline: ckpt_example.jobs:build``, ``transform: ckpt_example.jobs:clean``) and shipped as
a zip (``py_files:``) the way ``spark-submit --py-files`` ships it."""
