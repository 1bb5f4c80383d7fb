"""A process's host memory in CRIU's images: zero pages left out at the checkpoint
(trim.py), and brought back on demand at a restore (lazy.py: CRIU's lazy pages over
userfaultfd, served from the image's chunks by gpuos's page server, server.py, with the
pages the driver reads kept eager, pagemap.py). criuimg.py reads and writes the little
of CRIU's image format these need."""
