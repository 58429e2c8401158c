"""Files through the API: uploads validated line by line (:mod:`~llmbatch.api.files.upload`), stored, read,
listed and deleted (:mod:`~llmbatch.api.files.files`), the batches' result files
(:mod:`~llmbatch.api.files.result_files`) and the File objects and 404s they answer with
(:mod:`~llmbatch.api.files.views`)."""
