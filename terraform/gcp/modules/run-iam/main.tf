# Service accounts with the same split as the AWS roles, derived from the same layout.json
# (generated from ddiloco_geo.keys.role_prefixes()). Object access is limited by IAM conditions on
# the object name; listing cannot be limited by prefix on GCS, so each account may list the bucket.

locals {
  layout      = jsondecode(file("${path.module}/layout.json"))
  object_root = "projects/_/buckets/${var.bucket_name}/objects/${var.run_prefix}/"

  role_prefixes = merge(
    {
      for fleet in var.learner_fleets : "learner-${fleet}" => {
        for access, prefixes in local.layout.roles.learner :
        access => [for p in prefixes : replace(p, "${local.layout.learner_placeholder}/", "${fleet}-")]
      }
    },
    { syncer = local.layout.roles.syncer },
  )

  # CEL: a "dir/" prefix matches by startsWith, a key by equality.
  conditions = {
    for role, access in local.role_prefixes : role => {
      for kind, prefixes in access : kind => join(" || ", [
        for p in prefixes : endswith(p, "/") || endswith(p, "-") ? "resource.name.startsWith(\"${local.object_root}${p}\")" : "resource.name == \"${local.object_root}${p}\""
      ])
    }
  }
}

resource "google_service_account" "role" {
  for_each = local.role_prefixes

  project      = var.project
  account_id   = substr("dd-${each.key}", 0, 30)
  display_name = "ddiloco-geo ${each.key} (gs://${var.bucket_name}/${var.run_prefix})"
}

resource "google_storage_bucket_iam_member" "read" {
  for_each = local.role_prefixes

  bucket = var.bucket_name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.role[each.key].email}"

  condition {
    title      = "ddiloco-read-${each.key}"
    expression = "resource.type == \"storage.googleapis.com/Bucket\" || ${local.conditions[each.key].read}"
  }
}

resource "google_storage_bucket_iam_member" "write" {
  for_each = local.role_prefixes

  bucket = var.bucket_name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.role[each.key].email}"

  condition {
    title      = "ddiloco-write-${each.key}"
    expression = local.conditions[each.key].write
  }
}
