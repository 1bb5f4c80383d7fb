"""The image store: images as manifests over content-addressed chunks (docs/image-format.md).

    images.py   ImageStore: naming, staging, atomic publish, verify, usage, gc
    content.py  ingest (a staged image's files into chunks), ImageContent (files back out)
    chunks.py   ChunkStore: the chunks on disk and in memory, their lock
    chunker.py  where files are cut: page-aligned, content-defined
    streamer.py CRIU's image streamer: a restore's CRIU files from the chunks into its pipes
    decoders.py worker processes that read, decompress and check chunks into shared memory
"""

from .chunks import ChunkStore
from .content import ImageContent, IngestStats, ingest
from .images import (PIECE, SHARED_CHUNKS, STAGING_MARK, GcResult, ImageEntry, ImageStore,
                     ImageUsage, fsync_path, hash_files)

__all__ = ["ChunkStore", "ImageContent", "IngestStats", "ingest", "PIECE", "SHARED_CHUNKS",
           "STAGING_MARK", "GcResult", "ImageEntry", "ImageStore", "ImageUsage", "fsync_path",
           "hash_files"]
