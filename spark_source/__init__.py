"""A PySpark data source reading streamq producers directly: no broker in between.

from spark_source import StreamQDataSource
spark.dataSource.register(StreamQDataSource)
spark.readStream.format("streamq").option("endpoints", "h1:7400,h2:7400") ...
"""

from .datasource import StreamQDataSource

__all__ = ["StreamQDataSource"]
