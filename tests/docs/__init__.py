"""Tests of the documentation: every example runs, every page and name is listed, the
package map matches the tree.
"""
