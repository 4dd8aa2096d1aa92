"""The API: meshes, remote calls, mesh tensors, recordings, making a mesh.
The package root (``monarch_nb``) exports its public names."""
