"""On-demand host memory for a restore: CRIU's lazy pages (userfaultfd), the pages served
from the image's chunks by gpuos's page server (server.py), the pages the driver reads at
its restore kept eager (pagemap.py).  lazy.py runs it for one restore."""
