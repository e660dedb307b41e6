"""Tests of spark_source/: the data source in a real local SparkSession (the programs it
runs are in programs/).
"""
