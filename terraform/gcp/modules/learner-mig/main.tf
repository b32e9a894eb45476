# Spot learners on GCP: an instance template (SPOT provisioning, shielded VM, no external IP) whose
# user data installs the agent, and a regional managed instance group that recreates preempted VMs.
# GCE gives 30 s of preemption notice and shuts down through ACPI; the unit's TimeoutStopSec=25
# fits inside it.

locals {
  deploy_dir = coalesce(var.deploy_dir, "${path.module}/../../../../deploy")
  # Shorter per-request timeout on GCE, so a flush at preemption ends well inside 25 s.
  settings = merge({ DDILOCO_STORAGE__TIMEOUT_S = "10" }, var.settings)

  env_file = templatefile("${local.deploy_dir}/env/ddiloco-geo.env.tmpl", {
    role          = "learner"
    run_id        = var.run_id
    store_url     = var.store_url
    bucket_region = var.bucket_region
    region        = "gcp-${var.region}"
    extra_env     = join("\n", [for k, v in local.settings : "${k}=${v}"])
  })

  user_data = templatefile("${local.deploy_dir}/cloud-init/learner.yaml.tmpl", {
    cloud                 = "gcp"
    fleet                 = var.fleet
    package_spec          = var.package_spec
    lifecycle_hook        = ""
    web_identity_role_arn = var.web_identity_role_arn == null ? "" : var.web_identity_role_arn
    env_b64               = base64encode(local.env_file)
    unit_b64              = filebase64("${local.deploy_dir}/systemd/ddiloco-geo@.service")
    node_agent_unit_b64   = filebase64("${local.deploy_dir}/systemd/ddiloco-node-agent.service")
    node_setup_b64        = filebase64("${local.deploy_dir}/bin/ddiloco-node-setup")
    node_agent_b64        = filebase64("${local.deploy_dir}/bin/ddiloco-node-agent")
  })
}

resource "google_compute_instance_template" "learner" {
  project      = var.project
  name_prefix  = "${var.fleet}-"
  machine_type = var.machine_type
  labels       = merge(var.labels, { ddiloco-fleet = var.fleet })

  scheduling {
    provisioning_model          = "SPOT"
    preemptible                 = true
    automatic_restart           = false
    on_host_maintenance         = "TERMINATE"
    instance_termination_action = "DELETE"
  }

  disk {
    source_image = var.image
    disk_size_gb = var.disk_size_gb
    boot         = true
    auto_delete  = true
  }

  network_interface {
    network    = var.network
    subnetwork = var.subnetwork
  }

  service_account {
    email  = var.service_account_email
    scopes = ["cloud-platform"]
  }

  shielded_instance_config {
    enable_secure_boot          = true
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    user-data              = local.user_data
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "google_compute_region_instance_group_manager" "learners" {
  project            = var.project
  name               = "${var.fleet}-learners"
  region             = var.region
  base_instance_name = var.fleet
  target_size        = var.target_size

  version {
    instance_template = google_compute_instance_template.learner.id
  }

  update_policy {
    type                  = "PROACTIVE"
    minimal_action        = "REPLACE"
    max_surge_fixed       = 3
    max_unavailable_fixed = 0
  }
}
