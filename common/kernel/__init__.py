"""The torch-only kernel: what a chapter's core files may import besides torch and their own chapter.

Every file here imports only the standard library, torch and this folder, so a piece copied out of
the course (common/copy_sets.py) takes the kernel files it needs and nothing else of `common`.
"""
